"""Curvature of the loss w.r.t. the prototype bank: the Gauss-Newton statistics, exact
Hessian blocks (PRISM.md §4), and EK-FAC over every parameter (the whole-model baseline)."""
