"""Shipped price snapshots (CSV package data, read by broker.plan.catalog)."""
