"""Building blocks of the model family: linear, norm, rotary, activation, paged attention."""
