"""Adapters that run external kernel packages behind our `Experts` interface.

Each adapter imports its package only when a layer is built (the registry's `ADAPTERS` entry names
the package and how to install it), converts our `MoEWeights` once into the package's layout, and
takes the same keyword-only `apply` call as our kernels. The layout conversions that need no package
live in their own modules, so CPU tests check them without it.
"""
