"""Modules that serve every boundary: the outbox, alerts, job runs, buyers and their API keys."""
