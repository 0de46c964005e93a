"""Tests for synflow.storage: engines, the Database pool and migrations."""
