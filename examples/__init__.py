"""A user's own code, as `mpt-train` takes it: model and data factories (see README)."""
