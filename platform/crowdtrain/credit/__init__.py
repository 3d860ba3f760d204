"""Credit for accepted work: a ledger of entries, granted when a step commits and reversed by entries of their own."""
