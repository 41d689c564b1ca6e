"""Locust load tests: Triton users, traffic profiles, prompt sets and the report."""
