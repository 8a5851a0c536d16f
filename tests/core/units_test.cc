#include "core/units.h"

#include <gtest/gtest.h>

namespace nnsim {
namespace {

TEST(Units, ParsesBareNumbersAsBaseUnits) {
  EXPECT_DOUBLE_EQ(*parse_quantity("25e9", Dimension::kBytesPerSecond), 25e9);
  EXPECT_DOUBLE_EQ(*parse_quantity(" 1.5 ", Dimension::kSeconds), 1.5);
}

TEST(Units, ParsesDecimalBinaryAndBitUnits) {
  EXPECT_DOUBLE_EQ(*parse_quantity("25 GB/s", Dimension::kBytesPerSecond), 25e9);
  EXPECT_DOUBLE_EQ(*parse_quantity("200 Gb/s", Dimension::kBytesPerSecond), 25e9);
  EXPECT_DOUBLE_EQ(*parse_quantity("400Gbps", Dimension::kBytesPerSecond), 50e9);
  EXPECT_DOUBLE_EQ(*parse_quantity("80 GiB", Dimension::kBytes), 80.0 * 1024 * 1024 * 1024);
  EXPECT_DOUBLE_EQ(*parse_quantity("1.5 us", Dimension::kSeconds), 1.5e-6);
  EXPECT_DOUBLE_EQ(*parse_quantity("312 TFLOP/s", Dimension::kFlopsPerSecond), 312e12);
}

TEST(Units, RejectsUnitsOfTheWrongDimension) {
  auto r = parse_quantity("25 GB/s", Dimension::kSeconds);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("unknown unit 'GB/s'"), std::string::npos);
  EXPECT_FALSE(parse_quantity("fast", Dimension::kSeconds).ok());
}

TEST(Units, RejectsNumbersThatAreNotFinite) {
  for (const char* text : {"inf", "nan", "inf GB/s", "-inf"}) {
    auto r = parse_quantity(text, Dimension::kBytesPerSecond);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_NE(r.error().message().find("not a finite number"), std::string::npos) << text;
  }
}

TEST(Units, FormatsDurationsInTheirLargestUnit) {
  EXPECT_EQ(format_duration(3.456), "3.456 s");
  EXPECT_EQ(format_duration(119.0), "119.000 s");
  EXPECT_EQ(format_duration(720.0), "12.0 min");
  EXPECT_EQ(format_duration(5.25 * 3600), "5.2 hours");
  EXPECT_EQ(format_duration(8.1 * 86400), "8.1 days");
}

TEST(Units, FormatsForHumans) {
  EXPECT_EQ(format_bytes(1536.0 * 1024 * 1024), "1.50 GiB");
  EXPECT_EQ(format_seconds(0.0123), "12.30 ms");
  EXPECT_EQ(format_rate(25e9), "25.0 GB/s");
  EXPECT_EQ(format_flops(312e12), "312 TFLOP/s");
}

}  // namespace
}  // namespace nnsim
