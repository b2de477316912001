"""What the tests share: the suite's own plugins and helpers (no test imports another test file)."""
