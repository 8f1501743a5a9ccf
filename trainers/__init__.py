"""absl launchers: each parses its flags and calls one `mpt_keras` function."""
