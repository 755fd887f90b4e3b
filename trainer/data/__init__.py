"""The data path: a dataset's rows rendered by format, tokenized once into a cache, and drawn as
batches of flat token arrays."""
