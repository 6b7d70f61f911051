"""Deployments described for every layer to read: a model on a GPU with its links (the cost
model's rooflines). The engine's reference runners, the transfer process's modelled copies and
the benchmarks all time work with it, so it sits below all of them."""
