"""Conformance rows for RETURNN's own optimizers, checked against float64 numpy rules
written from ../shared/reference/optimizer-semantics.md section 13."""

from __future__ import annotations

SPECS: list = []
