"""One step on the model: the runner (layout, logit rows, forward, sampling), the step's flat batch
and the paged model, the CUDA graphs of decode steps, and a request's image rows."""
