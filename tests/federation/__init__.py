"""Tests of the federation sender core and the inbound /send validator."""
