"""Tests of the PySpark token validator (spark/)."""
