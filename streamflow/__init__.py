"""streamflow package."""
