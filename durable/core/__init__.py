"""Pure core: no Django imports."""
