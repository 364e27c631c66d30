"""Offline reports on finished (or running) runs."""
