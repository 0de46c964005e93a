"""Integration tests: real processes, real TCP, real PostgreSQL, Redis and Spark."""
