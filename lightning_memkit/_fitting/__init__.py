"""Fitting a run to a budget: the search (``search``) and the plan it returns with its code (``plan``)."""
