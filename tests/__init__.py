"""plait's test suite: one folder per package of src/plait (and bench/), top-level modules' tests here."""
