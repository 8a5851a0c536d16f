// "Did you mean ...?" for unknown names (core/suggest.h).
#include "core/suggest.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace nnsim {
namespace {

TEST(Suggest, TheClosestNameWithinAFewEdits) {
  EXPECT_EQ(suggest("a100-sxm4-80g", {"a100-sxm4-80gb", "h100-sxm5-80gb"}),
            " (did you mean 'a100-sxm4-80gb'?)");
  EXPECT_EQ(suggest("anything", {}), "");
}

TEST(Suggest, NamesContainingAnAbbreviation) {
  const std::vector<std::string> ids = {"bloom-176b-production-384gpu",
                                        "mosaic-mpt-7b-a10040gb-8gpu-seq2048-bf16",
                                        "mosaic-mpt-7b-a10040gb-8gpu-seq4096-bf16", "other"};
  EXPECT_EQ(suggest("BLOOM", ids), " (did you mean 'bloom-176b-production-384gpu'?)");
  EXPECT_EQ(suggest("mpt-7b", ids),
            " (did you mean one of: mosaic-mpt-7b-a10040gb-8gpu-seq2048-bf16, "
            "mosaic-mpt-7b-a10040gb-8gpu-seq4096-bf16?)");
}

TEST(Suggest, AShortListWholeALongOneItsFirstDozenAndCount) {
  EXPECT_EQ(suggest("zzzz", {"first", "second", "third"}), " (known: first, second, third)");
  std::vector<std::string> many;
  for (int i = 0; i < 20; ++i) many.push_back("case" + std::to_string(100 + i));
  const std::string s = suggest("unrelated-name", many);
  EXPECT_NE(s.find("case100, "), std::string::npos) << s;
  EXPECT_NE(s.find("case111, ... 20 in all)"), std::string::npos) << s;
  EXPECT_EQ(s.find("case112"), std::string::npos) << s;
}

}  // namespace
}  // namespace nnsim
