"""Scaffolding shared by the tests (pools with known bytes, polling, wire frames, a fake engine and tokenizer,
a `kvfence serve` process, a reference sampler, the fault matrix, a JSON schema); no test lives here."""
