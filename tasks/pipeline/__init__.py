"""The product's pipeline logic (profile -> fit -> plan -> launch -> watch -> re-plan) as plain
functions; flows/ wraps them as Prefect tasks and flows."""
