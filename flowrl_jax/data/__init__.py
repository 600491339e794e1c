"""The embedded shapes world: prompt grammar, renderer and prompt-set files (`shapes`)."""
