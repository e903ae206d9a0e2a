"""What both sides of the wire agree on: values, errors, tokens, limits, the pb codec."""
