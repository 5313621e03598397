"""`specedge distill`: train a small draft for a target on text the target writes."""
