"""Model families that live outside gamma_titan/, as a user's own package would: each is
registered by an entry point (group `gamma_titan.families`) that a test writes into a
temporary site folder (tests/test_new_family.py)."""
