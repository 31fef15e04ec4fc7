"""Kubernetes operator for PersiaJob: pure rendering and status logic (render.py,
status.py, plan.py) behind thin kopf handlers (handlers.py, reconciler.py)."""
