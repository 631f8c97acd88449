"""Privacy on the device: PII redaction (Presidio + spaCy), SLM rephrasing, protection modes."""
