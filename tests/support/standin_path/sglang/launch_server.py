"""``python -m sglang.launch_server ...`` -> the stand-in, with the same flags."""

from tests.support.sglang_standin import main

if __name__ == "__main__":
    main()
