"""Rewards: rule functions dispatched on each record's `data_source`, user functions, a remote service."""
