"""Helpers that run as separate processes in integration tests."""
