"""spotfill's working parts: plain functions and small models; flows/ wraps them for Prefect."""
