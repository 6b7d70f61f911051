"""Shared-memory rings, semaphores, channels, signal arrays, namespaces and cleanup."""
