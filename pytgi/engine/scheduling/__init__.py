"""Continuous batching: the scheduler, a request's state, and the types a step passes between the
scheduler and the runner."""
