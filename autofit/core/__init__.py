"""Foundations every layer uses: errors, the config and its enums, budgets, search spaces, trial records, files."""
