"""``datastore plan``: what staging, holding, shuffling a dataset will cost."""
