"""Performance harnesses: ratios measured side by side in one process run."""
