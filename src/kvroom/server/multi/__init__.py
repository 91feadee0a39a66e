"""Several models in one server under one memory budget (``kvroom serve A B C``)."""
