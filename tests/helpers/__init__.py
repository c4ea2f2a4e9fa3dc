"""Scaffolding shared by the tests (pools with known bytes, polling, wire frames); no test lives here."""
