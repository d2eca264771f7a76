"""The conformance suite: DataStoreLoader against torch's DataLoader, DistributedSampler and
StatefulDataLoader (and PyTorch Lightning), scenario by scenario (docs/loader.md)."""
