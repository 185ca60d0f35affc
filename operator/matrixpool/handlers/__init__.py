"""Thin kopf handlers: parse the body into the model, call pure code, patch status."""
