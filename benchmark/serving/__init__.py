"""Helpers for the serving benchmark and the A/B harness: HTTP client, request sets, metrics,
server launching and the A/B report."""
