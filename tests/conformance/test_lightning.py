"""PyTorch Lightning as its users write it (default settings: the 2-batch sanity check,
validation every epoch), fed by DataStoreLoader and by torch's loaders (DataLoader;
StatefulDataLoader where a checkpoint resumes mid-epoch): what the model sees."""

from __future__ import annotations

import glob
import logging
import warnings

import pytest
import torch

from conformance.common import flat, ours, theirs, write_dataset

pl = pytest.importorskip("pytorch_lightning", reason="pytorch-lightning is not installed")
pytest.importorskip("torchdata", reason="torchdata is not installed")

N, B = 64, 8
STEPS = N // B


class Recorder(pl.LightningModule):
    """A linear model that records the ``idx`` of every batch it trains and validates on."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)
        self.train_ids: list[list[int]] = []
        self.val_runs: list[list[int]] = []

    def training_step(self, batch, i):
        self.train_ids.append(batch["idx"].tolist())
        return self.lin(batch["x"].flatten(1)).mean()

    def on_validation_epoch_start(self) -> None:
        self.val_runs.append([])

    def validation_step(self, batch, i):
        self.val_runs[-1].extend(batch["idx"].tolist())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_dataset(str(tmp_path_factory.mktemp("lightning") / "d.h5"), N)


def fit(tmp, train, val=None, ckpt_path=None, callbacks=(), **trainer_kw) -> Recorder:
    model = Recorder()
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
        default_root_dir=tmp,
        **trainer_kw,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on num_workers and the like
        trainer.fit(model, train, val, ckpt_path=ckpt_path)
    return model


def loaders(path: str, kind: str):
    """(train, val) of one kind: torch's DataLoader (val unshuffled, as users write it), or
    ours."""
    if kind == "torch":
        val = torch.utils.data.DataLoader(theirs(path, B).dataset, batch_size=B)
        return theirs(path, B), val
    return ours(path, B), ours(path, B, seed=1)


@pytest.mark.parametrize("kind", ["torch", "ours"])
def test_defaults_sanity_check_then_every_validation_covers_the_set(data, tmp_path, kind):
    """Issue 22, 2a: the sanity check takes 2 validation batches; the first validation after
    it covered 48 of 64 samples with ours before the fix. Now, as with torch: every run of
    validation the whole set once, every training epoch the whole set once, a new order."""
    model = fit(tmp_path, *loaders(data, kind), max_epochs=2)
    sanity, *runs = model.val_runs
    assert len(sanity) == 2 * B and len(runs) == 2
    assert all(sorted(r) == list(range(N)) for r in runs)
    epochs = [flat(model.train_ids[k : k + STEPS]) for k in (0, STEPS)]
    assert len(model.train_ids) == 2 * STEPS
    assert all(sorted(e) == list(range(N)) for e in epochs) and epochs[0] != epochs[1]


@pytest.mark.parametrize("kind", ["torch", "ours"])
def test_val_check_interval_validates_the_whole_set_each_time(data, tmp_path, kind):
    model = fit(tmp_path, *loaders(data, kind), max_epochs=1, val_check_interval=0.5)
    assert [len(r) for r in model.val_runs] == [2 * B, N, N]
    assert all(sorted(r) == list(range(N)) for r in model.val_runs[1:])


@pytest.mark.parametrize("kind", ["torch", "ours"])
def test_limit_train_batches_draws_new_batches_every_epoch(data, tmp_path, kind):
    """3 of 8 batches an epoch: each epoch 24 distinct samples, never the same 24 again (a
    pass that is not finished is not repeated: ours starts the next epoch's order)."""
    train, _ = loaders(data, kind)
    model = fit(tmp_path, train, max_epochs=3, limit_train_batches=3, num_sanity_val_steps=0)
    epochs = [flat(model.train_ids[k : k + 3]) for k in (0, 3, 6)]
    assert len(model.train_ids) == 9 and all(len(set(e)) == 3 * B for e in epochs)
    assert len({tuple(sorted(e)) for e in epochs}) == 3


@pytest.mark.parametrize("kind", ["torch", "ours"])
def test_a_checkpoint_mid_epoch_resumes_exactly(data, tmp_path, kind):
    """A run of 2 epochs checkpoints at step 5 (mid-epoch). fit(ckpt_path=...) with new loaders
    and model trains the rest of epoch 0 exactly as the uninterrupted run did, then a whole
    epoch: ours the very batches of the uninterrupted run; torch's StatefulDataLoader another
    permutation (its generator is not where the uninterrupted run's was; documented)."""

    def train():
        return theirs(data, B, stateful=True) if kind == "torch" else ours(data, B)

    every = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ck", every_n_train_steps=5, save_top_k=-1
    )
    whole = fit(tmp_path, train(), max_epochs=2, callbacks=[every])
    assert len(whole.train_ids) == 2 * STEPS
    (mid,) = glob.glob(str(tmp_path / "ck" / "*step=5.ckpt"))
    rest = fit(tmp_path, train(), ckpt_path=mid, max_epochs=2)
    assert rest.train_ids[:3] == whole.train_ids[5:STEPS]
    assert sorted(flat(rest.train_ids[3:])) == list(range(N))
    assert (rest.train_ids[3:] == whole.train_ids[STEPS:]) == (kind == "ours")


@pytest.mark.parametrize("kind", ["torch", "ours"])
def test_max_steps_mid_epoch_then_save_and_resume(data, tmp_path, kind):
    """fit(max_steps=5) stops mid-epoch; a checkpoint saved after it counts the epoch as done
    (Lightning's rule, for both): fit(ckpt_path=..., max_epochs=2) trains epoch 1 only. Ours
    gives it epoch 1's batches of the uninterrupted run (Lightning calls set_epoch(1) on
    ``loader.sampler``, the loader itself), torch's DataLoader a new permutation."""
    whole = fit(tmp_path, ours(data, B), max_epochs=2) if kind == "ours" else None
    first = fit(tmp_path, loaders(data, kind)[0], max_steps=5, num_sanity_val_steps=0)
    assert len(first.train_ids) == 5
    if whole is not None:
        assert first.train_ids == whole.train_ids[:5]
    path = tmp_path / "stopped.ckpt"
    first.trainer.save_checkpoint(path)
    rest = fit(tmp_path, loaders(data, kind)[0], ckpt_path=str(path), max_epochs=2)
    assert len(rest.train_ids) == STEPS and sorted(flat(rest.train_ids)) == list(range(N))
    if whole is not None:
        assert rest.train_ids == whole.train_ids[STEPS:]
