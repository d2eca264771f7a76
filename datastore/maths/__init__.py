"""Pure functions, numpy only: blocks, order, owners, messages, what one rank receives."""
