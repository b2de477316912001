"""The shipped configs: one file a named run, `--config=NAME` (configs/ at the repository
root is a link to this directory). `meshtrain configs` lists them."""
