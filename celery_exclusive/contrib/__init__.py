"""Optional integrations with other frameworks; each is imported only when used."""
