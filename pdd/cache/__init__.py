"""What MainDecode's radix tree holds, as the router sees it: block hashes (pure code)."""
