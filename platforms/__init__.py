"""Built-in platforms. Each is a pluggy plugin registered through the `shuili.platforms` entry point."""
