// Placeholder: tests of the recurrent (decode) path are being written.
#include <gtest/gtest.h>
TEST(DecodePlaceholder, Builds) { SUCCEED(); }
