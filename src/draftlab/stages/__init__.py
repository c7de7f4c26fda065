"""Pipeline stages as plain functions of a resolved config (the CLIs are thin wrappers around them)."""
