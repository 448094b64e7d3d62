"""Meshes, logical-axis rules and multi-host start-up (``dayzero.sharding``).

This package imports none of ``dayzero.model``, ``dayzero.convert`` or ``dayzero.engine``.
"""
