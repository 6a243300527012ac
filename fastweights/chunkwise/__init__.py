"""Chunkwise-parallel training forms (plain PyTorch, any device), reached through
`fastweights.chunk(model, ...)`: gated-linear and delta classes (gated.py, delta.py), Mesa's
chunked conjugate gradient (mesa.py), and the inner mini-batch form of trained memories
(minibatch.py). (The folder is not called `chunk` so that it never shadows the function.)"""
