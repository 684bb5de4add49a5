"""Factors beyond 1/GAS (issue 10 item 4): exact, read once per backward, refused when
bad, shown by explain and checked by audit, and the window objective that motivated them."""
